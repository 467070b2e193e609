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
``ceil(len(block_ids) / blocks_per_chunk)``. Runs of consecutive GPU blocks that land on
consecutive sub-blocks of one chunk move as one copy.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvoffload import faults
from kvoffload.base import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from kvoffload.errors import ConfigError, KvOffloadError
from kvoffload.release import release_all

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class WorkerRegion(Protocol):
    """What the worker needs of a region (``SharedOffloadRegion`` with a worker rank)."""

    @property
    def num_chunks(self) -> int: ...

    def create_next_worker_view(self, tensor_page_size: int) -> torch.Tensor: ...

    def create_next_canonical_view(self, tensor_page_size: int) -> torch.Tensor: ...

    def cleanup(self) -> None: ...


#: (first GPU block, chunk id, first sub-block, number of blocks)
CopyRun = tuple[int, int, int, int]


def plan_copy_runs(
    block_ids: Sequence[int], chunk_ids: Sequence[int], blocks_per_chunk: int
) -> list[CopyRun]:
    """Group a transfer into runs that are contiguous on both sides (see the module docstring)."""
    needed = -(-len(block_ids) // blocks_per_chunk)
    if len(chunk_ids) != needed:
        raise ConfigError(
            "chunk_ids",
            f"{len(block_ids)} blocks at {blocks_per_chunk} per chunk need {needed} chunks, "
            f"got {len(chunk_ids)}",
        )
    runs: list[CopyRun] = []
    for i, block in enumerate(block_ids):
        chunk, sub = chunk_ids[i // blocks_per_chunk], i % blocks_per_chunk
        if runs:
            first_block, run_chunk, first_sub, count = runs[-1]
            if run_chunk == chunk and first_sub + count == sub and first_block + count == block:
                runs[-1] = (first_block, run_chunk, first_sub, count + 1)
                continue
        runs.append((block, chunk, sub, 1))
    return runs


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

    def _check_ids(self, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec) -> list[CopyRun]:
        if self._shut_down:
            raise KvOffloadError("the offloading worker has been shut down")
        if not isinstance(cpu, CPULoadStoreSpec):
            raise ConfigError("spec", f"expected a CPULoadStoreSpec, got {type(cpu).__name__}")
        bad_blocks = [b for b in gpu.block_ids if b >= self.num_gpu_blocks]
        if bad_blocks:
            raise ConfigError("block_ids", f"{bad_blocks[:4]} outside 0..{self.num_gpu_blocks - 1}")
        bad_chunks = [c for c in cpu.chunk_ids if c >= self.num_cpu_chunks]
        if bad_chunks:
            raise ConfigError("chunk_ids", f"{bad_chunks[:4]} outside 0..{self.num_cpu_chunks - 1}")
        return plan_copy_runs(gpu.block_ids, cpu.chunk_ids, self.blocks_per_chunk)

    def _transfer(self, job_id: int, runs: list[CopyRun], to_cpu: bool, stream_name: str) -> None:
        if job_id in self._unreported:
            raise KvOffloadError(f"job {job_id} is already in flight")
        size = sum(count for *_, count in runs) * self.bytes_per_block
        self._unreported.add(job_id)
        if self.is_cuda:
            self._transfer_cuda(job_id, runs, to_cpu, stream_name, size)
            return
        started = time.perf_counter()
        success = self._copy(runs, to_cpu, non_blocking=False, job_id=job_id)
        self._finished.append(TransferResult(job_id, success, size, time.perf_counter() - started))

    def _transfer_cuda(
        self, job_id: int, runs: list[CopyRun], to_cpu: bool, stream_name: str, size: int
    ) -> None:
        import torch

        stream = self._streams[stream_name]
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        # Stores read blocks the compute stream may still be writing; loads overwrite blocks
        # it may still be reading. Either way the side stream waits for it first.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            start.record(stream)
            success = self._copy(runs, to_cpu, non_blocking=True, job_id=job_id)
            # Recorded even after a failure: the job is reported once what was queued is done.
            end.record(stream)
        self._in_flight.append(_Transfer(job_id, success, size, start, end))

    def _copy(self, runs: list[CopyRun], to_cpu: bool, non_blocking: bool, job_id: int) -> bool:
        try:
            for gpu, cpu in zip(self._gpu_views, self._cpu_views, strict=True):
                for block, chunk, sub, count in runs:
                    host = cpu[chunk, sub : sub + count]
                    device = gpu[block : block + count]
                    if to_cpu:
                        host.copy_(device, non_blocking=non_blocking)
                    else:
                        device.copy_(host, non_blocking=non_blocking)
        except Exception:
            log.exception("offloading job %d failed", job_id)
            return False
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        runs = self._check_ids(src_spec, dst_spec)
        self._transfer(job_id, runs, to_cpu=True, stream_name="store")
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        runs = self._check_ids(dst_spec, src_spec)
        self._transfer(job_id, runs, to_cpu=False, stream_name="expedited" if expedited else "load")
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

    def _drop_views(self) -> None:
        self._in_flight.clear()
        self._streams.clear()
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
            ("drop the worker's CPU and GPU views", self._drop_views),
        ]
        if region is not None:
            steps.append(("clean up the worker's region", region.cleanup))
        release_all(steps)
