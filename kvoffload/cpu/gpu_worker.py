"""CPUOffloadingWorker: moves KV blocks between the GPU cache and the CPU chunk region.

Layout. Each KV-cache tensor has the GPU blocks as its first dimension; a block is
``page = tensor[0].numel() * element_size`` bytes. For each tensor the worker takes
one CPU view of ``(num_cpu_chunks, page * blocks_per_chunk)`` bytes: the next slice of
this worker's slot in every row of the region (``create_next_worker_view``), the same
bytes for every worker in the canonical layout (``create_next_canonical_view``), or a
private tensor when there is no region. A chunk holds ``blocks_per_chunk`` consecutive
sub-blocks of ``page`` bytes in each of those views.

Block -> chunk mapping. A transfer pairs ``GPULoadStoreSpec(block_ids)`` with
``CPULoadStoreSpec(chunk_ids)``; block ``i`` of the transfer goes to sub-block
``i % blocks_per_chunk`` of chunk ``chunk_ids[i // blocks_per_chunk]``, so chunks fill
from sub-block 0 and only the last one may be partial. ``len(chunk_ids)`` must be
``ceil(len(block_ids) / blocks_per_chunk)``, and neither side may name an id twice (two
blocks would land on one sub-block, or one block be written twice).

Copies. The plan is computed with numpy, not a Python loop per block: a run is a stretch
of consecutive GPU blocks that lands on consecutive sub-blocks of one chunk. CPU tensors
are copied through numpy views of their memory, where indexing moves whole blocks (a
memcpy each, in C): a run of at least ``LONG_RUN_BYTES`` is one slice assignment, and the
blocks of shorter runs are gathered and scattered by index arrays, ``TILE_BYTES`` at a
time so the intermediate stays in cache. A transfer of ``PARALLEL_COPY_BYTES`` or more is
cut into pieces copied by ``torch.get_num_threads()`` threads, as torch's own ``copy_``
would be. CUDA tensors copy run by run with ``copy_`` on a side stream (the same
function runs on CPU tensors in the tests).

Streams. On CUDA every copy is ``non_blocking`` on a side stream (store, load and
expedited load each have one, so transfers in one direction stay ordered), after the
side stream waits for the compute stream; an event recorded after the copies marks the
job finished. On CPU tensors copies are synchronous and the job is finished on return.
The region is not pinned (``cudaHostRegister``): copies to pageable memory are correct,
just slower.

Ownership. The caller owns ``mmap_region`` until the constructor returns; a constructor
that fails leaves it to the caller. From then on ``shutdown`` releases it, always:
transfers are stopped (and the device synchronised if that fails, since a copy may
still target the region), the views are dropped, and only then is the region cleaned.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Protocol

from kvoffload import faults
from kvoffload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.host_register import host_register, host_unregister
from kvoffload.errors import ConfigError, KvOffloadError
from kvoffload.release import release_all

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray

    from kvoffload.cpu.shared_offload_region import SharedOffloadRegion

log = logging.getLogger(__name__)

#: The largest single host registration: drivers limit (and slow down on) huge ones.
MAX_HOST_REGISTER_CHUNK_BYTES = 64 << 30
#: Registering only this worker's slots must leave out at least this many bytes per row to be
#: worth one registration call per row instead of a few for the whole region.
MIN_HOST_REGISTER_SAVED_BYTES = 3 << 20


def pin_mmap_region(region: SharedOffloadRegion, worker_slot_only: bool = False) -> None:
    """Register the region (vLLM's ``pin_mmap_region``) for DMA: all of it, or none.

    Whole rows in chunks of at most ``MAX_HOST_REGISTER_CHUNK_BYTES`` (a chunk ends on a row,
    so no block copy straddles two registrations), or, with ``worker_slot_only`` and enough
    saved per row, this worker's slot of every row. A refused registration undoes the ones
    before it, last first, and leaves the region pageable; on success the region records the
    addresses, so its cleanup unregisters them before it unmaps.
    """
    base = region._base
    if base is None:
        return
    base_ptr = base.data_ptr()
    total, stride = region.total_size_bytes, region._row_stride
    chunk = max(MAX_HOST_REGISTER_CHUNK_BYTES // stride, 1) * stride
    ranges: Iterator[tuple[int, int]] = (
        (offset, min(chunk, total - offset)) for offset in range(0, total, chunk)
    )
    saved_per_row = stride - region.cpu_page_size
    if worker_slot_only and region.rank is not None:
        if saved_per_row >= max(region.page_size, MIN_HOST_REGISTER_SAVED_BYTES):
            ranges = region.iter_worker_slot_ranges()
        else:
            log.info("Registering the whole region: its own slots would save %d bytes a row", saved_per_row)
    registered: list[int] = []
    for offset, size in ranges:
        address = base_ptr + offset
        if not host_register(address, size):
            log.warning(
                "host_register refused %d bytes at offset %d of %d; the region stays pageable",
                size,
                offset,
                total,
            )
            for done in reversed(registered):
                host_unregister(done)
            return
        registered.append(address)
    region.pinned_addresses.extend(registered)
    region.is_pinned = True


class WorkerRegion(Protocol):
    """What the worker needs of a region (``SharedOffloadRegion`` with a worker rank)."""

    @property
    def num_chunks(self) -> int: ...

    def create_next_worker_view(self, tensor_page_size: int) -> torch.Tensor: ...

    def create_next_canonical_view(self, tensor_page_size: int) -> torch.Tensor: ...

    def cleanup(self) -> None: ...


#: (first GPU block, chunk id, first sub-block, number of blocks)
CopyRun = tuple[int, int, int, int]

#: A run at least this long is copied as one slice; shorter ones are gathered in tiles.
#: Below it the fixed cost of one slice copy (~2 us) costs more than a second pass through
#: cache: runs of 16 KiB one by one moved at 0.52x a plain copy, in tiles at 0.6x; runs
#: of 64 KiB one by one at 0.83x (bench/bench_worker.py's machine, one thread).
LONG_RUN_BYTES = 64 << 10
#: Bytes of blocks gathered and scattered per index operation: big enough that the fixed
#: cost per tile vanishes, small enough that the gathered tile is still in cache.
TILE_BYTES = 1 << 20
#: A CPU transfer of at least this many bytes is split over ``torch.get_num_threads()``
#: threads, as torch splits a large ``copy_``: one core's memcpy is not the machine's
#: bandwidth. Smaller ones stay on the caller's thread (a hand-off costs ~50 us).
PARALLEL_COPY_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """One transfer, position by position (``int64`` numpy arrays), and its runs.

    Position ``i`` moves GPU block ``blocks[i]`` to/from sub-block ``subs[i]`` of chunk
    ``chunks[i]``; run ``r`` is positions ``starts[r] .. starts[r] + counts[r] - 1``.
    """

    blocks: NDArray[np.int64]
    chunks: NDArray[np.int64]
    subs: NDArray[np.int64]
    starts: NDArray[np.intp]
    counts: NDArray[np.intp]
    longest_run: int
    shortest_run: int

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.size)

    def runs(self) -> list[CopyRun]:
        s = self.starts
        return list(
            zip(
                self.blocks[s].tolist(),
                self.chunks[s].tolist(),
                self.subs[s].tolist(),
                self.counts.tolist(),
                strict=True,
            )
        )


def _repeated(ids: Collection[int]) -> list[int]:
    return sorted(i for i, count in Counter(ids).items() if count > 1)[:4]


def make_copy_plan(block_ids: Collection[int], chunk_ids: Collection[int], blocks_per_chunk: int) -> CopyPlan:
    """The plan of one transfer (see the module docstring); ``ConfigError`` if it is not one."""
    import numpy as np

    n = len(block_ids)
    needed = -(-n // blocks_per_chunk)
    if len(chunk_ids) != needed:
        raise ConfigError(
            "chunk_ids",
            f"{n} blocks at {blocks_per_chunk} per chunk need {needed} chunks, got {len(chunk_ids)}",
        )
    for key, ids in (("block_ids", block_ids), ("chunk_ids", chunk_ids)):
        if len(set(ids)) != len(ids):
            raise ConfigError(key, f"{_repeated(ids)} named more than once in one transfer")
    blocks = np.fromiter(block_ids, dtype=np.int64, count=n)
    position = np.arange(n, dtype=np.int64)
    chunks = np.repeat(np.fromiter(chunk_ids, dtype=np.int64, count=needed), blocks_per_chunk)[:n]
    return _plan(blocks, chunks, position % blocks_per_chunk)


def _plan(blocks: NDArray[np.int64], chunks: NDArray[np.int64], subs: NDArray[np.int64]) -> CopyPlan:
    import numpy as np

    n = blocks.size
    # Within a run, block - position is constant; a run ends where it changes or a chunk starts.
    offset = blocks - np.arange(n, dtype=np.int64)
    ends = (offset[1:] != offset[:-1]) | (subs[1:] == 0)
    starts = np.flatnonzero(np.concatenate(([n > 0], ends)))
    counts = np.concatenate((starts[1:], [n])) - starts
    longest, shortest = (int(counts.max()), int(counts.min())) if n else (0, 0)
    return CopyPlan(blocks, chunks, subs, starts, counts, longest, shortest)


def split_plan(plan: CopyPlan, pieces: int) -> list[CopyPlan]:
    """``plan`` cut into at most ``pieces`` plans of consecutive positions, runs cut at the cuts."""
    n = plan.num_blocks
    pieces = max(1, min(pieces, n))
    edges = [n * i // pieces for i in range(pieces + 1)]
    return [
        _plan(plan.blocks[lo:hi], plan.chunks[lo:hi], plan.subs[lo:hi])
        for lo, hi in pairwise(edges)
        if hi > lo
    ]


def plan_copy_runs(
    block_ids: Collection[int], chunk_ids: Collection[int], blocks_per_chunk: int
) -> list[CopyRun]:
    """Group a transfer into runs that are contiguous on both sides (see the module docstring)."""
    return make_copy_plan(block_ids, chunk_ids, blocks_per_chunk).runs()


def block_view(tensor: torch.Tensor) -> NDArray[np.int8]:
    """The numpy view of an int8 CPU tensor (same memory): ``(blocks, page)`` or ``(chunks, bpc, page)``.

    Indexing its leading dimensions moves whole blocks, each as one memcpy in C; numpy
    drops the GIL while it copies int8 data, which lets ``_copy_on_host`` use threads.
    """
    return tensor.detach().numpy()


def copy_on_host(
    gpu: NDArray[np.int8],
    cpu: NDArray[np.int8],
    plan: CopyPlan,
    page: int,
    to_cpu: bool,
    *,
    long_run_bytes: int = LONG_RUN_BYTES,
    tile_bytes: int = TILE_BYTES,
) -> None:
    """Move ``plan`` between two block views (``block_view``) of one KV tensor."""
    blocks, chunks, subs = plan.blocks, plan.chunks, plan.subs
    if plan.longest_run * page >= long_run_bytes:
        long_runs = plan.counts * page >= long_run_bytes
        s = plan.starts[long_runs]
        for b, c, sub, n in zip(
            blocks[s].tolist(),
            chunks[s].tolist(),
            subs[s].tolist(),
            plan.counts[long_runs].tolist(),
            strict=True,
        ):
            if to_cpu:
                cpu[c, sub : sub + n] = gpu[b : b + n]
            else:
                gpu[b : b + n] = cpu[c, sub : sub + n]
        if plan.shortest_run * page >= long_run_bytes:
            return
        import numpy as np

        short = np.repeat(~long_runs, plan.counts)
        blocks, chunks, subs = blocks[short], chunks[short], subs[short]
    tile = max(1, tile_bytes // page)
    for i in range(0, blocks.size, tile):
        b, c, sub = blocks[i : i + tile], chunks[i : i + tile], subs[i : i + tile]
        if to_cpu:
            cpu[c, sub] = gpu[b]
        else:
            gpu[b] = cpu[c, sub]


def copy_with_torch(
    gpu: torch.Tensor, cpu: torch.Tensor, runs: Sequence[CopyRun], to_cpu: bool, non_blocking: bool
) -> None:
    """Move ``runs`` with one ``copy_`` each: the device path (CUDA streams, other devices).

    ``gpu`` is ``(blocks, page)`` and ``cpu`` ``(chunks, bpc, page)``, both int8.
    """
    for block, chunk, sub, count in runs:
        host = cpu[chunk, sub : sub + count]
        device = gpu[block : block + count]
        if to_cpu:
            host.copy_(device, non_blocking=non_blocking)
        else:
            device.copy_(host, non_blocking=non_blocking)


@dataclass(slots=True)
class _Transfer:
    """A CUDA job whose copies are queued on a side stream."""

    job_id: int
    success: bool
    size: int
    start: Any  # torch.cuda.Event
    end: Any  # torch.cuda.Event


class CPUOffloadingWorker(OffloadingWorker):
    """GPU <-> CPU block transfers over the shared region (or private tensors without one)."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        mmap_region: WorkerRegion | None = None,
        canonical_layout: bool = False,
    ) -> None:
        import torch

        if (
            isinstance(blocks_per_chunk, bool)
            or not isinstance(blocks_per_chunk, int)
            or blocks_per_chunk < 1
        ):
            raise ConfigError("blocks_per_chunk", f"must be a positive integer, got {blocks_per_chunk!r}")
        if isinstance(num_cpu_chunks, bool) or not isinstance(num_cpu_chunks, int) or num_cpu_chunks < 0:
            raise ConfigError("num_cpu_chunks", f"must be a non-negative integer, got {num_cpu_chunks!r}")
        if mmap_region is not None and mmap_region.num_chunks != num_cpu_chunks:
            raise ConfigError(
                "num_cpu_chunks",
                f"{num_cpu_chunks} does not match the region's {mmap_region.num_chunks} chunks",
            )
        tensors = list(kv_caches)
        if not tensors:
            raise ConfigError("kv_caches", "no KV-cache tensors to offload")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ConfigError("kv_caches", f"tensors are on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.is_cuda = self.device.type == "cuda"
        self.blocks_per_chunk = blocks_per_chunk
        self.num_cpu_chunks = num_cpu_chunks
        self.num_gpu_blocks = tensors[0].shape[0] if tensors[0].dim() else 0
        self.page_sizes: list[int] = []
        for i, t in enumerate(tensors):
            if t.dim() < 1 or t.shape[0] != self.num_gpu_blocks or self.num_gpu_blocks == 0:
                raise ConfigError(
                    f"kv_caches[{i}]",
                    f"shape {tuple(t.shape)}: the first dimension must be the "
                    f"{self.num_gpu_blocks} GPU blocks",
                )
            if not t.is_contiguous():
                # A reshape of a non-contiguous tensor would copy, and loads would land in the copy.
                raise ConfigError(f"kv_caches[{i}]", "must be contiguous so blocks can be viewed as bytes")
            page = t[0].numel() * t.element_size()
            if page == 0:
                raise ConfigError(f"kv_caches[{i}]", "blocks of zero bytes")
            self.page_sizes.append(page)

        self._gpu_views: list[torch.Tensor] = [
            t.view(self.num_gpu_blocks, -1).view(torch.int8) for t in tensors
        ]
        self._cpu_views: list[torch.Tensor] = []
        for page in self.page_sizes:
            size = page * blocks_per_chunk
            if mmap_region is None:
                flat = torch.zeros(
                    (num_cpu_chunks, size),
                    dtype=torch.int8,
                    pin_memory=self.is_cuda and torch.cuda.is_available(),
                )
            elif canonical_layout:
                flat = mmap_region.create_next_canonical_view(size)
            else:
                flat = mmap_region.create_next_worker_view(size)
            # (chunk, sub-block, byte): rows keep the region's stride, sub-blocks are contiguous.
            self._cpu_views.append(flat.view(num_cpu_chunks, blocks_per_chunk, page))

        # CPU tensors move through numpy block views (see copy_on_host); others with torch.
        self._copy_threads = torch.get_num_threads()
        self._copy_pool: ThreadPoolExecutor | None = None  # started by the first large copy
        self._host_views: list[tuple[NDArray[np.int8], NDArray[np.int8], int]] = []
        if self.device.type == "cpu":
            self._host_views = [
                (block_view(gpu), block_view(cpu), page)
                for gpu, cpu, page in zip(self._gpu_views, self._cpu_views, self.page_sizes, strict=True)
            ]
        self._streams: dict[str, Any] = {}
        if self.is_cuda:
            self._streams = {
                name: torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
                for name in ("store", "load", "expedited")
            }
        self._in_flight: list[_Transfer] = []
        self._finished: list[TransferResult] = []
        self._unreported: set[int] = set()
        self._shut_down = False
        # Last: from here on the worker owns the region.
        self._mmap_region = mmap_region

    @property
    def bytes_per_block(self) -> int:
        """Bytes one GPU block occupies across all KV-cache tensors."""
        return sum(self.page_sizes)

    # ----------------------------------------------------------------- transfers

    def _check_ids(self, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec) -> CopyPlan:
        if self._shut_down:
            raise KvOffloadError("the offloading worker has been shut down")
        if not isinstance(cpu, CPULoadStoreSpec):
            raise ConfigError("spec", f"expected a CPULoadStoreSpec, got {type(cpu).__name__}")
        plan = make_copy_plan(gpu.block_ids, cpu.chunk_ids, self.blocks_per_chunk)
        for key, ids, limit in (
            ("block_ids", plan.blocks, self.num_gpu_blocks),
            ("chunk_ids", plan.chunks, self.num_cpu_chunks),
        ):
            if ids.size and int(ids.max()) >= limit:
                raise ConfigError(key, f"{ids[ids >= limit][:4].tolist()} outside 0..{limit - 1}")
        return plan

    def _transfer(self, job_id: int, plan: CopyPlan, to_cpu: bool, stream_name: str) -> None:
        if job_id in self._unreported:
            raise KvOffloadError(f"job {job_id} is already in flight")
        size = plan.num_blocks * self.bytes_per_block
        self._unreported.add(job_id)
        if self.is_cuda:
            self._transfer_cuda(job_id, plan, to_cpu, stream_name, size)
            return
        started = time.perf_counter()
        success = self._copy(plan, to_cpu, non_blocking=False, job_id=job_id)
        self._finished.append(TransferResult(job_id, success, size, time.perf_counter() - started))

    def _transfer_cuda(self, job_id: int, plan: CopyPlan, to_cpu: bool, stream_name: str, size: int) -> None:
        import torch

        stream = self._streams[stream_name]
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        # Stores read blocks the compute stream may still be writing; loads overwrite blocks
        # it may still be reading. Either way the side stream waits for it first.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            start.record(stream)
            success = self._copy(plan, to_cpu, non_blocking=True, job_id=job_id)
            # Recorded even after a failure: the job is reported once what was queued is done.
            end.record(stream)
        self._in_flight.append(_Transfer(job_id, success, size, start, end))

    def _copy_on_host(self, plan: CopyPlan, to_cpu: bool) -> None:
        threads = self._copy_threads
        if threads < 2 or plan.num_blocks * self.bytes_per_block < PARALLEL_COPY_BYTES:
            for gpu, cpu, page in self._host_views:
                copy_on_host(gpu, cpu, plan, page, to_cpu)
            return
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(threads, thread_name_prefix="kvoffload_copy")
        # numpy lets go of the GIL while it copies, so the pieces run in parallel.
        pieces = split_plan(plan, -(-threads // len(self._host_views)))
        futures = [
            self._copy_pool.submit(copy_on_host, gpu, cpu, piece, page, to_cpu)
            for gpu, cpu, page in self._host_views
            for piece in pieces
        ]
        # Every piece ends before the job does, failed or not: none may still write afterwards.
        wait(futures)
        for future in futures:
            future.result()

    def _copy(self, plan: CopyPlan, to_cpu: bool, non_blocking: bool, job_id: int) -> bool:
        try:
            if self._host_views:
                self._copy_on_host(plan, to_cpu)
            else:
                runs = plan.runs()
                for gpu_view, cpu_view in zip(self._gpu_views, self._cpu_views, strict=True):
                    copy_with_torch(gpu_view, cpu_view, runs, to_cpu, non_blocking)
        except Exception:
            log.exception("offloading job %d failed", job_id)
            return False
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        plan = self._check_ids(src_spec, dst_spec)
        self._transfer(job_id, plan, to_cpu=True, stream_name="store")
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        plan = self._check_ids(dst_spec, src_spec)
        self._transfer(job_id, plan, to_cpu=False, stream_name="expedited" if expedited else "load")
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        still: list[_Transfer] = []
        for transfer in self._in_flight:
            if transfer.end.query():
                seconds = transfer.start.elapsed_time(transfer.end) / 1000
                finished.append(TransferResult(transfer.job_id, transfer.success, transfer.size, seconds))
            else:
                still.append(transfer)
        self._in_flight = still
        for result in finished:
            self._unreported.discard(result.job_id)
        return finished

    def wait(self, job_ids: set[int]) -> None:
        for transfer in self._in_flight:
            if transfer.job_id in job_ids:
                transfer.end.synchronize()

    # ----------------------------------------------------------------- shutdown

    def _stop_transfers(self) -> None:
        try:
            faults.point("cleanup.worker")
            for stream in self._streams.values():
                stream.synchronize()
        except BaseException:
            if self.is_cuda:
                import torch

                # A copy may still target the region: it must finish before the unmap.
                torch.cuda.synchronize(self.device)
            raise

    def _stop_copy_threads(self) -> None:
        pool, self._copy_pool = self._copy_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _drop_views(self) -> None:
        self._in_flight.clear()
        self._streams.clear()
        self._host_views.clear()  # numpy views keep their tensors, and so the region, alive
        self._cpu_views.clear()
        self._gpu_views.clear()

    def shutdown(self) -> None:
        """Stop transfers, drop every view, then always clean the region. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        region, self._mmap_region = self._mmap_region, None
        steps: list[tuple[str, Any]] = [
            ("stop the offloading transfers", self._stop_transfers),
            ("stop the copy threads", self._stop_copy_threads),
            ("drop the worker's CPU and GPU views", self._drop_views),
        ]
        if region is not None:
            steps.append(("clean up the worker's region", region.cleanup))
        release_all(steps)
