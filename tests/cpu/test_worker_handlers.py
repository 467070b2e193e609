"""vLLM 0.33's worker shape: one handler per direction, KV-cache groups, and the canonical layout.

Written from the behaviour of vLLM's ``SingleDirectionOffloadingHandler`` and its tests
(``test_gpu_worker.py``, ``test_canonical_layout.py``), on CPU tensors; the CUDA variants skip
without a GPU. Every byte of every row is compared, so a copy that strays is caught.
"""

from __future__ import annotations

import pytest
import torch

from kvoffload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
    LoadStoreSpec,
    TransferResult,
)
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.gpu_worker import CPUOffloadingWorker, SingleDirectionOffloadingHandler
from kvoffload.errors import ConfigError, KvOffloadError
from tests.cpu.test_worker import FakeWorkerRegion

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CANARY = 0x5A


def random_int8(*shape: int, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8).to(device)


def rows_inside_wider_rows(chunks: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``(chunks, width)`` view whose rows sit between canary bytes, as a region slot does."""
    row = width + 40
    base = torch.full((chunks * row,), CANARY, dtype=torch.int8)
    return base, torch.as_strided(base, (chunks, width), (row, 1), 24)


def handler(
    gpu: list[torch.Tensor],
    cpu: list[torch.Tensor],
    bpc: int,
    refs: list[list[CanonicalKVCacheRef]],
    gpu_to_cpu: bool,
    canonical: bool = False,
) -> SingleDirectionOffloadingHandler:
    return SingleDirectionOffloadingHandler(
        gpu_tensors=gpu,
        cpu_tensors=cpu,
        blocks_per_chunk=bpc,
        layer_refs_per_group=refs,
        gpu_to_cpu=gpu_to_cpu,
        canonical_layout=canonical,
    )


def run(
    h: SingleDirectionOffloadingHandler, job: int, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec
) -> TransferResult:
    src, dst = (gpu, cpu) if h.gpu_to_cpu else (cpu, gpu)
    specs: tuple[LoadStoreSpec, LoadStoreSpec] = (src, dst)
    assert h.transfer_async(job, *specs)
    h.wait({job})
    [result] = h.get_finished()
    assert result.job_id == job
    assert result.success
    return result


# ---------------------------------------------------------------- jobs


def test_a_job_is_queued_until_get_finished_reports_it_once() -> None:
    page = 32
    h = handler(
        [random_int8(4, page, seed=0)],
        [torch.zeros(2, page, dtype=torch.int8)],
        1,
        [[CanonicalKVCacheRef(0, page)]],
        True,
    )
    assert h.transfer_async(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([1]))
    assert h.transfer_async(2, GPULoadStoreSpec([3]), CPULoadStoreSpec([0]))
    assert [t.job_id for t in h._transfers] == [1, 2]
    results = h.get_finished()
    assert [(r.job_id, r.transfer_size) for r in results] == [(1, page), (2, page)]
    assert all(r.transfer_time is not None and r.transfer_time >= 0 for r in results)
    assert h.get_finished() == []
    h.shutdown()


def test_shutdown_drains_and_releases_every_resource_then_refuses_jobs() -> None:
    page = 32
    gpu, cpu = [random_int8(4, page, seed=0)], [torch.zeros(2, page, dtype=torch.int8)]
    h = handler(gpu, cpu, 1, [[CanonicalKVCacheRef(0, page)]], False)
    h.transfer_async(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([1]))
    h.shutdown()
    assert not h._transfers
    assert not h._transfer_events
    assert (h._stream_pool, h._event_pool, h._buffer_pool) == ([], [], [])
    assert (h.src_tensors, h.dst_tensors, h._host_views, h._cpu_views) == ([], [], (), ())
    with pytest.raises(KvOffloadError, match="shut down"):
        h.transfer_async(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([1]))


# ---------------------------------------------------------------- KV-cache groups

PAGE, BPC = 48, 3


def three_groups() -> tuple[list[torch.Tensor], list[list[CanonicalKVCacheRef]]]:
    """One tensor per group; group 1 will move nothing."""
    gpu = [random_int8(10, PAGE, seed=g) for g in range(3)]
    return gpu, [[CanonicalKVCacheRef(g, PAGE)] for g in range(3)]


#: group 0: 4 blocks from sub-block 0 (chunks 5, 1); group 1: none; group 2: 2 blocks of a
#: request whose 5th block is the first here, so they start at sub-block 4 % 3 = 1 (chunk 3).
GROUP_BLOCKS: tuple[list[int], ...] = ([5, 6, 7, 1], [], [9, 2])
GROUP_CHUNKS: tuple[list[int], ...] = ([5, 1], [], [3])
BLOCK_INDICES = (0, 0, 4)
#: (group, GPU block, chunk, sub-block) of every block moved
GROUP_TARGETS = [(0, 5, 5, 0), (0, 6, 5, 1), (0, 7, 5, 2), (0, 1, 1, 0), (2, 9, 3, 1), (2, 2, 3, 2)]


def group_specs() -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    gpu = GPULoadStoreSpec(
        [b for blocks in GROUP_BLOCKS for b in blocks],
        group_sizes=[len(b) for b in GROUP_BLOCKS],
        block_indices=BLOCK_INDICES,
    )
    return gpu, CPULoadStoreSpec([c for chunks in GROUP_CHUNKS for c in chunks])


def test_each_group_fills_its_own_chunks_from_its_first_sub_block() -> None:
    gpu, refs = three_groups()
    bases, cpu = zip(*(rows_inside_wider_rows(6, BPC * PAGE) for _ in range(3)), strict=True)
    expected = [b.clone() for b in bases]
    for g, block, chunk, sub in GROUP_TARGETS:
        view = torch.as_strided(expected[g], cpu[g].shape, cpu[g].stride(), cpu[g].storage_offset())
        view[chunk, sub * PAGE : (sub + 1) * PAGE] = gpu[g][block]
    result = run(handler(gpu, list(cpu), BPC, refs, True), 1, *group_specs())
    assert result.transfer_size == len(GROUP_TARGETS) * PAGE
    for base, want in zip(bases, expected, strict=True):
        assert torch.equal(base, want)  # the skipped sub-blocks and the empty group's rows included


def test_each_group_loads_its_blocks_from_its_own_chunks() -> None:
    _, refs = three_groups()
    gpu = [torch.zeros(10, PAGE, dtype=torch.int8) for _ in range(3)]
    cpu = [random_int8(6, BPC * PAGE, seed=10 + g) for g in range(3)]
    expected = [t.clone() for t in gpu]
    for g, block, chunk, sub in GROUP_TARGETS:
        expected[g][block] = cpu[g][chunk, sub * PAGE : (sub + 1) * PAGE]
    run(handler(gpu, cpu, BPC, refs, False), 1, *group_specs())
    for got, want in zip(gpu, expected, strict=True):
        assert torch.equal(got, want)


def test_each_layer_moves_only_its_own_page_bytes() -> None:
    gpu = [random_int8(4, 64, seed=0)]
    base, cpu = rows_inside_wider_rows(2, 64)
    expected = base.clone()
    torch.as_strided(expected, cpu.shape, cpu.stride(), cpu.storage_offset())[1, :40] = gpu[0][3, :40]
    result = run(
        handler(gpu, [cpu], 1, [[CanonicalKVCacheRef(0, 40)]], True),
        1,
        GPULoadStoreSpec([3]),
        CPULoadStoreSpec([1]),
    )
    assert result.transfer_size == 40
    assert torch.equal(base, expected)  # the 24 padding bytes of the page stay as they were


def test_a_transfer_must_name_one_size_per_kv_cache_group() -> None:
    gpu, refs = three_groups()
    h = handler(gpu, [torch.zeros(6, BPC * PAGE, dtype=torch.int8) for _ in range(3)], BPC, refs, True)
    with pytest.raises(ConfigError) as info:
        h.transfer_async(1, GPULoadStoreSpec([0, 1], group_sizes=[1, 1]), CPULoadStoreSpec([0, 1]))
    assert info.value.key == "group_sizes"
    assert not h._transfers


def test_a_group_starting_inside_a_chunk_needs_the_chunk_it_spills_into() -> None:
    gpu, refs = three_groups()
    h = handler(gpu[:1], [torch.zeros(6, BPC * PAGE, dtype=torch.int8)], BPC, refs[:1], True)
    spec = GPULoadStoreSpec([0, 1, 2], block_indices=[1])  # sub-blocks 1, 2 of one chunk, 0 of the next
    with pytest.raises(ConfigError, match="need 2 chunks, got 1") as info:
        h.transfer_async(1, spec, CPULoadStoreSpec([0]))
    assert info.value.key == "chunk_ids"


def test_a_worker_takes_vllms_canonical_kv_caches_group_by_group() -> None:
    tensors = [random_int8(8, page, seed=page) for page in (16, 48, 32)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
        group_data_refs=[
            [CanonicalKVCacheRef(0, 16), CanonicalKVCacheRef(1, 48)],
            [CanonicalKVCacheRef(2, 32)],
        ],
    )
    before = [t.clone() for t in tensors]
    worker = CPUOffloadingWorker(caches, 2, 4)
    store = GPULoadStoreSpec([3, 4, 6], group_sizes=[2, 1], block_indices=[0, 0])
    worker.submit_store(1, store, CPULoadStoreSpec([2, 0]))
    [stored] = worker.get_finished()
    assert stored.transfer_size == 2 * (16 + 48) + 32
    for t in tensors:
        t.zero_()
    worker.submit_load(2, CPULoadStoreSpec([2, 0]), store)
    worker.get_finished()
    # Group 0 (blocks 3, 4) lives in tensors 0 and 1, group 1 (block 6) in tensor 2 only.
    for t, b, blocks in zip(tensors, before, ([3, 4], [3, 4], [6]), strict=True):
        restored = torch.zeros_like(b)
        restored[blocks] = b[blocks]
        assert torch.equal(t, restored)
    worker.shutdown()


# ---------------------------------------------------------------- the canonical layout

# A 4-token page of 4 heads of 64 bytes, K then V: 2048 canonical bytes per block.
HEADS, HEAD_BYTES, TOKENS = 4, 64, 4
CANONICAL_PAGE = 2 * TOKENS * HEADS * HEAD_BYTES


def shard_mapping(tp: int, rank: int, writers: int = 1, writer: int = 0) -> CanonicalPageMapping:
    """Where rank ``rank`` of ``tp`` keeps its heads in the canonical page: per token, one fragment."""
    frag = HEADS // tp * HEAD_BYTES
    row = HEADS * HEAD_BYTES
    k = CopyRun(0, rank * frag, frag, TOKENS, frag, row)
    v = CopyRun(TOKENS * frag, TOKENS * row + rank * frag, frag, TOKENS, frag, row)
    return CanonicalPageMapping(CANONICAL_PAGE, 2 * TOKENS * frag, (k, v), writers, writer, tp == 1)


def head_shard(kv: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank's GPU page of each block, from ``(blocks, K/V, token, head, byte)``."""
    heads = HEADS // tp
    return kv[:, :, :, rank * heads : (rank + 1) * heads, :].reshape(kv.shape[0], -1).contiguous()


def canonical_handler(
    gpu: torch.Tensor, cpu: torch.Tensor, bpc: int, mapping: CanonicalPageMapping, gpu_to_cpu: bool
) -> SingleDirectionOffloadingHandler:
    ref = CanonicalKVCacheRef(0, mapping.local_page_size_bytes, mapping)
    return handler([gpu], [cpu], bpc, [[ref]], gpu_to_cpu, canonical=True)


@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 4), (4, 2), (2, 1), (1, 4), (4, 4)])
def test_kv_written_at_one_tp_size_is_read_back_at_another(writer_tp: int, reader_tp: int, bpc: int) -> None:
    blocks = 4
    kv = random_int8(blocks, 2, TOKENS, HEADS, HEAD_BYTES, seed=writer_tp * 10 + reader_tp)
    chunks = [3, 1, 0, 2][: blocks // bpc]
    base, canonical = rows_inside_wider_rows(4, bpc * CANONICAL_PAGE)
    gpu_spec, cpu_spec = GPULoadStoreSpec(range(blocks)), CPULoadStoreSpec(chunks)
    for rank in range(writer_tp):
        store = canonical_handler(
            head_shard(kv, writer_tp, rank), canonical, bpc, shard_mapping(writer_tp, rank), True
        )
        assert run(store, rank, gpu_spec, cpu_spec).transfer_size == blocks * CANONICAL_PAGE // writer_tp
    # The writers assembled every block's whole page, in the layout no topology owns.
    expected = torch.full_like(base, CANARY)
    view = torch.as_strided(expected, canonical.shape, canonical.stride(), canonical.storage_offset())
    for i in range(blocks):
        sub = i % bpc
        view[chunks[i // bpc], sub * CANONICAL_PAGE : (sub + 1) * CANONICAL_PAGE] = kv[i].reshape(-1)
    assert torch.equal(base, expected)
    for rank in range(reader_tp):
        want = head_shard(kv, reader_tp, rank)
        got = torch.zeros_like(want)
        run(
            canonical_handler(got, canonical, bpc, shard_mapping(reader_tp, rank), False),
            rank,
            gpu_spec,
            cpu_spec,
        )
        assert torch.equal(got, want)


def test_replicas_holding_the_same_bytes_take_turns_writing_pages() -> None:
    page, bpc = 256, 2
    gpu = random_int8(4, page, seed=7)
    canonical = torch.zeros(2, bpc * page, dtype=torch.int8)
    whole = CopyRun(0, 0, page, 1, page, page)
    spec = (GPULoadStoreSpec([0, 1, 2, 3]), CPULoadStoreSpec([1, 0]))
    # Blocks 0..3 land on canonical pages 2, 3, 0, 1 (chunk * bpc + sub-block): rank 0 writes the
    # even ones (blocks 0 and 2), rank 1 the odd ones, whatever the block ids.
    rank0 = canonical_handler(
        gpu, canonical, bpc, CanonicalPageMapping(page, page, (whole,), 2, 0, True), True
    )
    assert run(rank0, 1, *spec).transfer_size == 2 * page
    pages = canonical.view(-1, page)
    assert torch.equal(pages[[2, 0]], gpu[[0, 2]])
    assert not pages[[3, 1]].any()
    rank1 = canonical_handler(
        gpu, canonical, bpc, CanonicalPageMapping(page, page, (whole,), 2, 1, True), True
    )
    run(rank1, 2, *spec)
    assert torch.equal(pages[[2, 3, 0, 1]], gpu)


def test_a_mapping_that_leaves_its_page_is_a_config_error() -> None:
    stray = CopyRun(0, 0, 128, 4, 128, 512)  # 4 fragments 512 apart: 1664 bytes past a 1024-byte page
    mapping = CanonicalPageMapping(1024, 512, (stray,), 1, 0, True)
    with pytest.raises(ConfigError, match="does not fit") as info:
        canonical_handler(
            torch.zeros(2, 512, dtype=torch.int8), torch.zeros(2, 1024, dtype=torch.int8), 1, mapping, True
        )
    assert info.value.key == "layer_refs_per_group[0]"


def test_the_canonical_layout_needs_a_mapping_for_every_layer() -> None:
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(torch.zeros(4, 64, dtype=torch.int8), 64)], [[CanonicalKVCacheRef(0, 64)]]
    )
    region = FakeWorkerRegion(2, 2 * 64)
    with pytest.raises(ConfigError, match="no canonical mapping"):
        CPUOffloadingWorker(caches, 2, 2, mmap_region=region, canonical_layout=True)
    assert region.cleanups == 0
    region.cleanup()


def test_the_canonical_layout_needs_the_shared_region() -> None:
    with pytest.raises(ConfigError) as info:
        CPUOffloadingWorker([torch.zeros(4, 64, dtype=torch.int8)], 2, 2, canonical_layout=True)
    assert info.value.key == "canonical_layout"


def test_a_canonical_worker_scatters_its_shard_into_the_shared_page_and_reloads_it() -> None:
    kv = random_int8(4, 2, TOKENS, HEADS, HEAD_BYTES, seed=3)
    mine = head_shard(kv, 2, 1)
    mapping = shard_mapping(2, 1)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(mine, mine.shape[1])], [[CanonicalKVCacheRef(0, mine.shape[1], mapping)]]
    )
    region = FakeWorkerRegion(2, 2 * CANONICAL_PAGE, workers=1)
    worker = CPUOffloadingWorker(caches, 2, 2, mmap_region=region, canonical_layout=True)
    assert region.calls == ["canonical"]
    blocks, chunks = GPULoadStoreSpec([0, 1, 2, 3]), CPULoadStoreSpec([1, 0])
    worker.submit_store(1, blocks, chunks)
    [stored] = worker.get_finished()
    assert stored.transfer_size == 4 * CANONICAL_PAGE // 2
    page = torch.frombuffer(bytearray(region.row(1)[:CANONICAL_PAGE]), dtype=torch.int8).view(
        2, TOKENS, HEADS, HEAD_BYTES
    )
    assert torch.equal(page[:, :, 2:], kv[0, :, :, 2:])  # rank 1's heads of block 0 ...
    assert not page[:, :, :2].any()  # ... and nothing where rank 0's go
    before = mine.clone()
    mine.zero_()
    worker.submit_load(2, chunks, blocks)
    worker.get_finished()
    assert torch.equal(mine, before)
    worker.shutdown()
    assert region.mm.closed


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 4), (4, 2), (2, 1)])
def test_cuda_kv_written_at_one_tp_size_is_read_back_at_another(writer_tp: int, reader_tp: int) -> None:
    blocks = 4
    kv = random_int8(blocks, 2, TOKENS, HEADS, HEAD_BYTES, seed=1)
    canonical = torch.zeros(blocks, CANONICAL_PAGE, dtype=torch.int8, pin_memory=True)
    gpu_spec, cpu_spec = GPULoadStoreSpec(range(blocks)), CPULoadStoreSpec(range(blocks))
    for rank in range(writer_tp):
        shard = head_shard(kv, writer_tp, rank).cuda()
        run(
            canonical_handler(shard, canonical, 1, shard_mapping(writer_tp, rank), True),
            rank,
            gpu_spec,
            cpu_spec,
        )
    torch.cuda.synchronize()
    assert torch.equal(canonical, kv.reshape(blocks, -1))
    for rank in range(reader_tp):
        got = torch.zeros_like(head_shard(kv, reader_tp, rank), device="cuda")
        run(
            canonical_handler(got, canonical, 1, shard_mapping(reader_tp, rank), False),
            rank,
            gpu_spec,
            cpu_spec,
        )
        assert torch.equal(got.cpu(), head_shard(kv, reader_tp, rank))
