"""CPUOffloadingWorker: moves KV blocks between the GPU cache and the CPU chunk region.

Shape (vLLM 0.33's). The worker owns three ``SingleDirectionOffloadingHandler``s: stores
(GPU -> CPU), loads (CPU -> GPU), and expedited loads, which have their own queue so they never
wait behind regular loads. A handler runs its transfers in the order they were submitted.

KV caches. vLLM hands the worker ``CanonicalKVCaches``: the tensors, each viewed as
``(num_blocks, page_size_bytes)`` int8, and per KV-cache group the layers (``CanonicalKVCacheRef``)
that live in them. A plain list of tensors, whose first dimension is the blocks, is one group
holding every tensor. For each tensor the worker takes one CPU view of ``(num_cpu_chunks,
page * blocks_per_chunk)`` bytes: the next slice of this worker's slot in every row of the
region (``create_next_worker_view``), the canonical page every worker shares
(``create_next_canonical_view``, see ``canonical_layout``), or a private tensor when there is
no region.

Block -> chunk mapping. A transfer pairs ``GPULoadStoreSpec(block_ids, group_sizes,
block_indices)`` with ``CPULoadStoreSpec(chunk_ids)``; both list their ids group by group.
Group ``g``'s blocks fill the sub-blocks of its chunks in order, starting at sub-block
``block_indices[g] % blocks_per_chunk`` of its first chunk (a request's blocks need not start
on a chunk boundary), so ``ceil((group_sizes[g] + skip) / blocks_per_chunk)`` chunks are its.
No id may be named twice (two blocks would land on one sub-block, or one block be written
twice). Each layer of the group moves its own ``page_size_bytes`` of each block. How the bytes
move is ``block_copy``'s (direct layout) or ``canonical_layout``'s.

Streams. On CUDA a transfer's copies are ``non_blocking`` on a side stream that first waits
for the compute stream (stores read blocks it may still be writing; loads overwrite blocks it
may still be reading or zeroing) and for the handler's previous transfer; an event recorded
after the copies marks the job finished. On CPU tensors copies are synchronous and a job is
finished on return; it is still reported by ``get_finished``, once.

Pinning. Where the platform pins host memory (vLLM's ``PIN_MEMORY``) and the KV caches are on
the accelerator, the worker registers the region with ``pin_mmap_region`` (its own slot of
every row, or the whole region under the canonical layout), as vLLM's does; a private buffer
is allocated pinned. A refused registration leaves the region pageable: copies stay correct.

Ownership. The caller owns ``mmap_region`` until the constructor returns; a constructor
that fails leaves it to the caller (pinned or not: the region's cleanup unregisters). From
then on ``shutdown`` releases it, always, as vLLM's does: each handler drains its transfers and
drops its views (a failure is logged, and the next handler still runs); if one failed, the
device is synchronised, since a copy may still target the region; then the region is cleaned.
Only the region's own cleanup failure is raised.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvoffload import faults
from kvoffload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from kvoffload.cpu.block_copy import (
    PARALLEL_COPY_BYTES,
    BlockCopyPlan,
    CopyThreads,
    block_view,
    copy_on_host,
    copy_with_torch,
    plan_group,
    plan_positions,
    repeated_ids,
    split_plan,
)
from kvoffload.cpu.canonical_layout import (
    CopyPlan,
    build_copy_plan,
    canonical_block_sizes,
    canonical_page_ids,
    check_mapping,
    copy_canonical_runs,
    identity_mapping,
)
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.host_register import host_register, host_unregister
from kvoffload.errors import ConfigError, KvOffloadError
from kvoffload.platforms import current_platform

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray

log = logging.getLogger(__name__)

# vLLM's names for the canonical layout's helpers (its tests import them from here).
_build_copy_plan = build_copy_plan
_canonical_page_ids = canonical_page_ids
_canonical_block_sizes = canonical_block_sizes

#: vLLM's ``HAS_TRITON`` (see ``__getattr__``): whether vLLM would take its Triton kernel for
#: small pinned loads. kvoffload has no Triton kernel: its loads take the copy path either way.
HAS_TRITON: bool


def __getattr__(name: str) -> Any:
    # Answering HAS_TRITON imports Triton, which a CLI start must not pay for: asked on first use.
    if name == "HAS_TRITON":
        return current_platform.has_triton()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------- pinning the region

#: The largest single host registration: drivers limit (and slow down on) huge ones.
MAX_HOST_REGISTER_CHUNK_BYTES = 64 << 30
#: Registering only this worker's slots must leave out at least this many bytes per row to be
#: worth one registration call per row instead of a few for the whole region.
MIN_HOST_REGISTER_SAVED_BYTES = 3 << 20


class PinnableRegion(Protocol):
    """What ``pin_mmap_region`` reads and records (``SharedOffloadRegion``'s names)."""

    _base: torch.Tensor | None
    _row_stride: int
    total_size_bytes: int
    cpu_page_size: int
    page_size: int
    rank: int | None
    is_pinned: bool
    pinned_addresses: list[int]

    def iter_worker_slot_ranges(self) -> Iterator[tuple[int, int]]: ...


def pin_mmap_region(region: PinnableRegion, worker_slot_only: bool = False) -> None:
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


class WorkerRegion(PinnableRegion, Protocol):
    """What the worker needs of a region (``SharedOffloadRegion`` with a worker rank)."""

    @property
    def num_chunks(self) -> int: ...

    def create_next_worker_view(self, tensor_page_size: int) -> torch.Tensor: ...

    def create_next_canonical_view(self, tensor_page_size: int) -> torch.Tensor: ...

    def cleanup(self) -> None: ...


# ----------------------------------------------------------------- one direction


class _HostEvent:
    """A device event's stand-in for host copies, which have finished when they return."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = 0.0

    def record(self, stream: object = None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _HostEvent) -> float:
        """Milliseconds from this event to ``end``, as ``torch.cuda.Event.elapsed_time``."""
        return (end.at - self.at) * 1000


@dataclass(slots=True)
class Transfer:
    """One submitted job of a handler (vLLM's ``Transfer``); finished once ``end_event`` is."""

    job_id: int
    stream: Any  # torch.cuda.Stream; None for host copies
    start_event: Any  # torch.cuda.Event or _HostEvent
    end_event: Any
    num_bytes: int
    success: bool = True


@dataclass(frozen=True, slots=True)
class _GroupCopy:
    """One KV-cache group of one transfer: its positions, and which of them a layer writes.

    ``written`` holds, for canonical stores, the positions whose page it is this rank's turn to
    write, per ``(num_writers, writer_index)`` of the group's layers that share pages.
    """

    group: int
    plan: BlockCopyPlan
    written: dict[tuple[int, int], BlockCopyPlan]

    def plan_for(self, ref: CanonicalKVCacheRef) -> BlockCopyPlan:
        mapping = ref.mapping
        if mapping is None:
            return self.plan
        return self.written.get((mapping.num_writers, mapping.writer_index), self.plan)


def _as_index_array(ids: Sequence[int] | NDArray[Any]) -> NDArray[np.int64]:
    import numpy as np

    return np.asarray(ids, dtype=np.int64).reshape(-1)


class SingleDirectionOffloadingHandler:
    """Transfers in one direction, GPU -> CPU or CPU -> GPU, run in the order submitted.

    ``gpu_tensors`` are ``(num_gpu_blocks, gpu page)`` int8 and ``cpu_tensors``
    ``(num_cpu_chunks, cpu page)`` int8 in the same order; a CPU page is ``blocks_per_chunk``
    GPU pages, or canonical pages under ``canonical_layout``. On CUDA, each transfer runs on a
    stream of the handler's pool that waits for the compute stream and for the transfer before
    it. ``host_memory_is_pinned`` is vLLM's switch between its Triton and DMA load kernels;
    kvoffload has one copy path, which does not depend on it.
    """

    # Views of the region's memory, dropped by shutdown, which vLLM's tests call on handlers
    # they build without __init__.
    _gpu_views: tuple[torch.Tensor, ...] = ()
    _cpu_views: tuple[torch.Tensor, ...] = ()
    _host_views: tuple[tuple[NDArray[np.int8], NDArray[np.int8]], ...] = ()

    def __init__(
        self,
        gpu_tensors: list[torch.Tensor],
        cpu_tensors: list[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: list[list[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        canonical_layout: bool = False,
        host_memory_is_pinned: bool = True,
        copy_threads: CopyThreads | None = None,
    ) -> None:
        import torch

        if not gpu_tensors or len(gpu_tensors) != len(cpu_tensors):
            raise ConfigError(
                "cpu_tensors", f"{len(cpu_tensors)} CPU tensors for {len(gpu_tensors)} GPU tensors"
            )
        devices = {t.device for t in gpu_tensors}
        if len(devices) != 1:
            raise ConfigError("gpu_tensors", f"tensors are on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.is_cuda = self.device.type == "cuda"
        cpu_page_sizes = (
            canonical_block_sizes(layer_refs_per_group, len(gpu_tensors))
            if canonical_layout
            else [t.shape[1] if t.ndim == 2 else 0 for t in gpu_tensors]
        )
        for i, (gpu, cpu) in enumerate(zip(gpu_tensors, cpu_tensors, strict=True)):
            if gpu.dtype != torch.int8 or gpu.ndim != 2 or gpu.stride(1) != 1:
                raise ConfigError(f"gpu_tensors[{i}]", "must be (blocks, page bytes) int8, bytes contiguous")
            if cpu.dtype != torch.int8 or cpu.ndim != 2 or cpu.stride(1) != 1 or cpu.device.type != "cpu":
                raise ConfigError(f"cpu_tensors[{i}]", "must be (chunks, page bytes) int8 in host memory")
            if cpu.shape[1] != cpu_page_sizes[i] * blocks_per_chunk:
                raise ConfigError(
                    f"cpu_tensors[{i}]",
                    f"a CPU page of {cpu.shape[1]} bytes is not {blocks_per_chunk} of {cpu_page_sizes[i]}",
                )
        for g, layer_refs in enumerate(layer_refs_per_group):
            for ref in layer_refs:
                where = f"layer_refs_per_group[{g}]"
                if not 0 <= ref.tensor_idx < len(gpu_tensors):
                    raise ConfigError(where, f"tensor_idx {ref.tensor_idx} of {len(gpu_tensors)} tensors")
                page = gpu_tensors[ref.tensor_idx].shape[1]
                if canonical_layout:
                    check_mapping(ref, page, cpu_page_sizes[ref.tensor_idx], where)
                elif not 0 < ref.page_size_bytes <= page:
                    raise ConfigError(
                        where, f"a layer page of {ref.page_size_bytes} bytes in a {page}-byte page"
                    )

        # Lists of their own: a handler's shutdown empties them, and the worker shares its tensors.
        self.src_tensors: list[torch.Tensor] = list(gpu_tensors if gpu_to_cpu else cpu_tensors)
        self.dst_tensors: list[torch.Tensor] = list(cpu_tensors if gpu_to_cpu else gpu_tensors)
        self.gpu_to_cpu = gpu_to_cpu
        self.layer_refs_per_group = layer_refs_per_group
        self.blocks_per_chunk = blocks_per_chunk
        self.canonical_layout = canonical_layout
        self.host_memory_is_pinned = host_memory_is_pinned
        self.num_gpu_blocks = gpu_tensors[0].shape[0]
        self.num_cpu_chunks = cpu_tensors[0].shape[0]
        # The CPU side as (chunk, sub-block, byte): rows keep the region's stride.
        self._gpu_views = tuple(gpu_tensors)
        self._cpu_views = tuple(
            cpu.view(self.num_cpu_chunks, blocks_per_chunk, page)
            for cpu, page in zip(cpu_tensors, cpu_page_sizes, strict=True)
        )
        # Host tensors move through numpy views of the same memory (see block_copy).
        if self.device.type == "cpu" and not canonical_layout:
            self._host_views = tuple(
                (block_view(gpu), block_view(cpu))
                for gpu, cpu in zip(self._gpu_views, self._cpu_views, strict=True)
            )
        self._copy_threads = copy_threads
        self._group_page_bytes = [sum(ref.page_size_bytes for ref in refs) for refs in layer_refs_per_group]
        # Per (group, layer) fragment plans under the canonical layout (vLLM's).
        self._canonical_copy_plans: list[list[CopyPlan]] | None = (
            [[build_copy_plan(ref, gpu_to_cpu) for ref in refs] for refs in layer_refs_per_group]
            if canonical_layout
            else None
        )
        # job_id -> end event; the jobs in submission order; streams and events to reuse.
        self._transfer_events: dict[int, Any] = {}
        self._transfers: deque[Transfer] = deque()
        self._stream_pool: list[Any] = []
        self._event_pool: list[Any] = []
        # vLLM keeps its pinned copy descriptors here for reuse; kvoffload's copies take none,
        # so it stays empty, and is released with the rest.
        self._buffer_pool: list[Any] = []

    # ----------------------------------------------------------------- planning

    def _plan(self, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec) -> list[_GroupCopy]:
        """Where each block goes, group by group; ``ConfigError`` before any byte moves."""
        for key, given in (("block_ids", gpu_spec.block_ids), ("chunk_ids", cpu_spec.block_ids)):
            # A set beats np.unique on the few ids of a step; numpy arrays are listed first.
            listed = given.tolist() if hasattr(given, "tolist") else given
            if len(set(listed)) != len(listed):
                raise ConfigError(key, f"{repeated_ids(listed)} named more than once in one transfer")
        blocks = _as_index_array(gpu_spec.block_ids)
        chunks = _as_index_array(cpu_spec.block_ids)
        sizes = [int(n) for n in gpu_spec.group_sizes]
        starts = [int(i) for i in gpu_spec.block_indices]
        if len(sizes) != len(self.layer_refs_per_group) or len(starts) != len(sizes):
            raise ConfigError(
                "group_sizes",
                f"{len(sizes)} group sizes and {len(starts)} block indices given, "
                f"the KV caches have {len(self.layer_refs_per_group)} groups",
            )
        if sum(sizes) != blocks.size or any(n < 0 for n in sizes):
            raise ConfigError("group_sizes", f"{sizes} do not split the {blocks.size} block ids")
        bpc = self.blocks_per_chunk
        skips = [start % bpc for start in starts]
        needed = [-(-(n + skip) // bpc) if n else 0 for n, skip in zip(sizes, skips, strict=True)]
        if sum(needed) != chunks.size:
            at = "" if skips == [0] else f" from sub-blocks {skips}"
            raise ConfigError(
                "chunk_ids",
                f"{blocks.size} blocks{at} at {bpc} per chunk need {sum(needed)} chunks, got {chunks.size}",
            )
        for key, ids, limit in (
            ("block_ids", blocks, self.num_gpu_blocks),
            ("chunk_ids", chunks, self.num_cpu_chunks),
        ):
            if ids.size and not 0 <= int(ids.min()) <= int(ids.max()) < limit:
                bad = ids[(ids >= limit) | (ids < 0)]
                raise ConfigError(key, f"{bad[:4].tolist()} outside 0..{limit - 1}")
        copies: list[_GroupCopy] = []
        block_at = chunk_at = 0
        for g, (n, skip, count) in enumerate(zip(sizes, skips, needed, strict=True)):
            group_blocks = blocks[block_at : block_at + n]
            group_chunks = chunks[chunk_at : chunk_at + count]
            block_at, chunk_at = block_at + n, chunk_at + count
            if n == 0:
                continue
            plan = plan_group(group_blocks, group_chunks, bpc, skip)
            copies.append(_GroupCopy(g, plan, self._written_pages(g, plan, group_chunks, skip)))
        return copies

    def _written_pages(
        self, group: int, plan: BlockCopyPlan, chunks: NDArray[np.int64], skip: int
    ) -> dict[tuple[int, int], BlockCopyPlan]:
        """On a canonical store, the pages each writer rotation of the group leaves to this rank.

        Ranks that hold the same bytes take turns by canonical page id (the same on every
        rank); loads, and layers with one writer, move every page.
        """
        if not (self.canonical_layout and self.gpu_to_cpu):
            return {}
        rotations = {
            (ref.mapping.num_writers, ref.mapping.writer_index)
            for ref in self.layer_refs_per_group[group]
            if ref.mapping is not None and ref.mapping.num_writers > 1
        }
        if not rotations:
            return {}
        ids = canonical_page_ids(chunks, self.blocks_per_chunk, plan.num_blocks, skip)
        written = {}
        for writers, index in rotations:
            mine = ids % writers == index
            written[writers, index] = plan_positions(plan.blocks[mine], plan.chunks[mine], plan.subs[mine])
        return written

    def _group_bytes(self, copy: _GroupCopy) -> int:
        refs = self.layer_refs_per_group[copy.group]
        if self._canonical_copy_plans is None:
            return copy.plan.num_blocks * self._group_page_bytes[copy.group]
        plans = self._canonical_copy_plans[copy.group]
        return sum(
            copy.plan_for(ref).num_blocks * frags.total_bytes for ref, frags in zip(refs, plans, strict=True)
        )

    # ----------------------------------------------------------------- copying

    def _copy(self, copies: Sequence[_GroupCopy], num_bytes: int, non_blocking: bool) -> None:
        if self._canonical_copy_plans is not None:
            self._copy_canonical(copies, non_blocking)
        elif self._host_views:
            self._copy_on_host(copies, num_bytes)
        else:
            self._copy_with_torch(copies, non_blocking)

    def _copy_canonical(self, copies: Sequence[_GroupCopy], non_blocking: bool) -> None:
        for copy in copies:
            for ref in self.layer_refs_per_group[copy.group]:
                assert ref.mapping is not None  # checked in __init__
                copy_canonical_runs(
                    self._gpu_views[ref.tensor_idx],
                    self._cpu_views[ref.tensor_idx],
                    copy.plan_for(ref),
                    ref.mapping.runs,
                    self.gpu_to_cpu,
                    non_blocking,
                )

    def _copy_with_torch(self, copies: Sequence[_GroupCopy], non_blocking: bool) -> None:
        for copy in copies:
            runs = copy.plan.runs()
            for ref in self.layer_refs_per_group[copy.group]:
                page = ref.page_size_bytes
                copy_with_torch(
                    self._gpu_views[ref.tensor_idx][:, :page],
                    self._cpu_views[ref.tensor_idx][:, :, :page],
                    runs,
                    self.gpu_to_cpu,
                    non_blocking,
                )

    def _copy_on_host(self, copies: Sequence[_GroupCopy], num_bytes: int) -> None:
        units = [
            (copy.plan, ref.tensor_idx, ref.page_size_bytes)
            for copy in copies
            for ref in self.layer_refs_per_group[copy.group]
        ]
        threads = self._copy_threads
        if threads is None or threads.threads < 2 or num_bytes < PARALLEL_COPY_BYTES:
            for plan, tensor, page in units:
                gpu, cpu = self._host_views[tensor]
                copy_on_host(gpu[:, :page], cpu[:, :, :page], plan, page, self.gpu_to_cpu)
            return
        # numpy lets go of the GIL while it copies, so the pieces run in parallel.
        pieces = -(-threads.threads // len(units))
        calls: list[Callable[[], None]] = []
        for plan, tensor, page in units:
            gpu, cpu = self._host_views[tensor]
            calls += [
                functools.partial(copy_on_host, gpu[:, :page], cpu[:, :, :page], piece, page, self.gpu_to_cpu)
                for piece in split_plan(plan, pieces)
            ]
        threads.run(calls)

    # ----------------------------------------------------------------- jobs

    def transfer_async(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Queue one job; ``ConfigError`` (nothing queued) if the specs do not fit the caches."""
        if not self.src_tensors:
            raise KvOffloadError("the offloading handler has been shut down")
        gpu_spec, cpu_spec = (src_spec, dst_spec) if self.gpu_to_cpu else (dst_spec, src_spec)
        if not isinstance(gpu_spec, GPULoadStoreSpec):
            raise ConfigError("spec", f"expected a GPULoadStoreSpec, got {type(gpu_spec).__name__}")
        if not isinstance(cpu_spec, CPULoadStoreSpec):
            raise ConfigError("spec", f"expected a CPULoadStoreSpec, got {type(cpu_spec).__name__}")
        copies = self._plan(gpu_spec, cpu_spec)
        num_bytes = sum(self._group_bytes(copy) for copy in copies)
        if self.is_cuda:
            transfer = self._submit_cuda(job_id, copies, num_bytes)
        else:
            start = self._event_pool.pop() if self._event_pool else _HostEvent()
            end = self._event_pool.pop() if self._event_pool else _HostEvent()
            start.record()
            success = self._copy_logged(job_id, copies, num_bytes, non_blocking=False)
            end.record()
            transfer = Transfer(job_id, None, start, end, num_bytes, success)
        self._transfer_events[job_id] = transfer.end_event
        self._transfers.append(transfer)
        return True

    def _submit_cuda(self, job_id: int, copies: Sequence[_GroupCopy], num_bytes: int) -> Transfer:
        import torch

        stream = self._stream_pool.pop() if self._stream_pool else torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        start = self._event_pool.pop() if self._event_pool else torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = self._event_pool.pop() if self._event_pool else torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._transfers:
            stream.wait_event(self._transfers[-1].end_event)
        with torch.cuda.stream(stream):
            start.record(stream)
            success = self._copy_logged(job_id, copies, num_bytes, non_blocking=True)
            # Recorded even after a failure: the job is reported once what was queued is done.
            end.record(stream)
        return Transfer(job_id, stream, start, end, num_bytes, success)

    def _copy_logged(
        self, job_id: int, copies: Sequence[_GroupCopy], num_bytes: int, non_blocking: bool
    ) -> bool:
        try:
            self._copy(copies, num_bytes, non_blocking)
        except Exception:
            log.exception("offloading job %d failed", job_id)
            return False
        return True

    def get_finished(self) -> list[TransferResult]:
        results: list[TransferResult] = []
        while self._transfers and self._transfers[0].end_event.query():
            transfer = self._transfers.popleft()
            seconds = transfer.start_event.elapsed_time(transfer.end_event) / 1000
            results.append(TransferResult(transfer.job_id, transfer.success, transfer.num_bytes, seconds))
            if transfer.stream is not None:
                self._stream_pool.append(transfer.stream)
            self._event_pool += (transfer.end_event, transfer.start_event)
            self._transfer_events.pop(transfer.job_id, None)
        return results

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            event = self._transfer_events.get(job_id)
            if event is not None:
                event.synchronize()

    def shutdown(self) -> None:
        """Drain this direction, then release its streams, events and views, even if draining fails.

        A transfer whose end cannot be waited for (a lost device) stops the draining: the ones
        after it are not waited for either, and the error is raised once all is released.
        """
        sync_error: Exception | None = None
        while self._transfers:
            try:
                self._transfers[0].end_event.synchronize()
            except Exception as e:
                log.exception(
                    "Failed to synchronize transfer end event; skipping %d remaining transfers",
                    len(self._transfers) - 1,
                )
                self._transfers.clear()
                sync_error = e
                break
            self._transfers.popleft()
        self._transfer_events.clear()
        self._stream_pool.clear()
        self._event_pool.clear()
        self._buffer_pool.clear()
        # Any view keeps the region's memory alive, numpy's through their tensors.
        self._host_views = self._gpu_views = self._cpu_views = ()
        self.src_tensors.clear()
        self.dst_tensors.clear()
        if sync_error is not None:
            raise sync_error


# ----------------------------------------------------------------- the worker


def _as_canonical_kv_caches(
    kv_caches: CanonicalKVCaches | Sequence[torch.Tensor], canonical_layout: bool
) -> CanonicalKVCaches:
    """vLLM's description of the caches; a list of tensors is one group over all of them."""
    if isinstance(kv_caches, CanonicalKVCaches):
        return kv_caches
    tensors: list[CanonicalKVCacheTensor] = []
    num_blocks = kv_caches[0].shape[0] if kv_caches and kv_caches[0].dim() else 0
    for i, t in enumerate(kv_caches):
        if t.dim() < 1 or t.shape[0] != num_blocks or num_blocks == 0:
            raise ConfigError(
                f"kv_caches[{i}]",
                f"shape {tuple(t.shape)}: the first dimension must be the {num_blocks} GPU blocks",
            )
        page = t[0].numel() * t.element_size()
        if page == 0:
            raise ConfigError(f"kv_caches[{i}]", "blocks of zero bytes")
        tensors.append(CanonicalKVCacheTensor(tensor=t, page_size_bytes=page))
    refs = [
        CanonicalKVCacheRef(
            i, t.page_size_bytes, identity_mapping(t.page_size_bytes) if canonical_layout else None
        )
        for i, t in enumerate(tensors)
    ]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[refs])


def _block_views(kv_caches: CanonicalKVCaches) -> list[torch.Tensor]:
    """Each KV-cache tensor as ``(blocks, page bytes)`` int8, over the same memory."""
    import torch

    if not kv_caches.tensors:
        raise ConfigError("kv_caches", "no KV-cache tensors to offload")
    views: list[torch.Tensor] = []
    for i, entry in enumerate(kv_caches.tensors):
        t, page = entry.tensor, entry.page_size_bytes
        if t.dim() == 0 or not t.is_contiguous():
            # A reshape of a non-contiguous tensor would copy, and loads would land in the copy.
            raise ConfigError(f"kv_caches[{i}]", "must be contiguous so blocks can be viewed as bytes")
        nbytes = t.numel() * t.element_size()
        if page <= 0 or nbytes % page:
            raise ConfigError(f"kv_caches[{i}]", f"{nbytes} bytes are not whole pages of {page}")
        views.append(t.view(torch.int8).view(-1, page))
    devices = {v.device for v in views}
    if len(devices) != 1:
        raise ConfigError("kv_caches", f"tensors are on several devices: {sorted(map(str, devices))}")
    blocks = {v.shape[0] for v in views}
    if len(blocks) != 1 or 0 in blocks:
        raise ConfigError("kv_caches", f"tensors hold different numbers of blocks, or none: {sorted(blocks)}")
    return views


class CPUOffloadingWorker(OffloadingWorker):
    """GPU <-> CPU block transfers over the shared region (or private tensors without one)."""

    # Read by shutdown, which vLLM's tests call on workers they build without __init__.
    _shut_down = False
    _on_host = False
    _copy_threads: CopyThreads | None = None

    def __init__(
        self,
        kv_caches: CanonicalKVCaches | Sequence[torch.Tensor],
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
        if canonical_layout and mmap_region is None:
            raise ConfigError("canonical_layout", "needs the shared region: the canonical page is shared")
        if not isinstance(kv_caches, CanonicalKVCaches) and not kv_caches:
            raise ConfigError("kv_caches", "no KV-cache tensors to offload")
        caches = _as_canonical_kv_caches(kv_caches, canonical_layout)
        gpu_tensors = _block_views(caches)
        refs = caches.group_data_refs
        cpu_block_sizes = (
            canonical_block_sizes(refs, len(gpu_tensors))
            if canonical_layout
            else [t.shape[1] for t in gpu_tensors]
        )
        self.device = gpu_tensors[0].device
        self.is_cuda = self.device.type == "cuda"
        self._on_host = self.device.type == "cpu"
        self.blocks_per_chunk = blocks_per_chunk
        self.num_cpu_chunks = num_cpu_chunks
        self.num_gpu_blocks = gpu_tensors[0].shape[0]
        self.page_sizes = [t.shape[1] for t in gpu_tensors]

        # Pinning serves the accelerator's DMA; host-to-host copies gain nothing from it.
        pin_memory = current_platform.is_pin_memory_available() and not self._on_host
        if mmap_region is not None and pin_memory:
            pin_mmap_region(mmap_region, worker_slot_only=not canonical_layout)
        host_memory_is_pinned = pin_memory and (mmap_region is None or mmap_region.is_pinned)
        cpu_tensors: list[torch.Tensor] = []
        for size in cpu_block_sizes:
            if mmap_region is None:
                cpu_tensors.append(
                    torch.zeros(
                        (num_cpu_chunks, size * blocks_per_chunk), dtype=torch.int8, pin_memory=pin_memory
                    )
                )
            elif canonical_layout:
                cpu_tensors.append(mmap_region.create_next_canonical_view(size * blocks_per_chunk))
            else:
                cpu_tensors.append(mmap_region.create_next_worker_view(size * blocks_per_chunk))

        self._copy_threads = CopyThreads(torch.get_num_threads()) if self._on_host else None
        make_handler = functools.partial(
            SingleDirectionOffloadingHandler,
            gpu_tensors=gpu_tensors,
            cpu_tensors=cpu_tensors,
            blocks_per_chunk=blocks_per_chunk,
            layer_refs_per_group=refs,
            canonical_layout=canonical_layout,
            host_memory_is_pinned=host_memory_is_pinned,
            copy_threads=self._copy_threads,
        )
        self._store_handler = make_handler(gpu_to_cpu=True)
        self._load_handler = make_handler(gpu_to_cpu=False)
        # Its own queue, so expedited loads do not wait behind regular loads.
        self._expedited_load_handler = make_handler(gpu_to_cpu=False)
        #: Jobs submitted and not yet reported, whichever handler runs them.
        self._unreported: set[int] = set()
        # Last: from here on the worker owns the region.
        self._mmap_region = mmap_region

    @property
    def bytes_per_block(self) -> int:
        """Bytes one GPU block occupies across all KV-cache tensors."""
        return sum(self.page_sizes)

    # ----------------------------------------------------------------- transfers

    def _submit(
        self, handler: SingleDirectionOffloadingHandler, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec
    ) -> bool:
        if self._shut_down:
            raise KvOffloadError("the offloading worker has been shut down")
        if job_id in self._unreported:
            raise KvOffloadError(f"job {job_id} is already in flight")
        queued = handler.transfer_async(job_id, src, dst)
        self._unreported.add(job_id)
        return queued

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """GPU -> CPU, asynchronous on CUDA."""
        return self._submit(self._store_handler, job_id, src_spec, dst_spec)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """CPU -> GPU, asynchronous on CUDA."""
        handler = self._expedited_load_handler if expedited else self._load_handler
        return self._submit(handler, job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        finished = (
            self._store_handler.get_finished()
            + self._load_handler.get_finished()
            + self._expedited_load_handler.get_finished()
        )
        for result in finished:
            self._unreported.discard(result.job_id)
        return finished

    def wait(self, job_ids: set[int]) -> None:
        self._store_handler.wait(job_ids)
        self._load_handler.wait(job_ids)
        self._expedited_load_handler.wait(job_ids)

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Drain both directions, then release the region, whatever failed before. Idempotent.

        A handler that fails to drain is logged and the release goes on (vLLM's behaviour); the
        device is then synchronised before the region is unmapped. Ctrl-C in the middle still
        releases the rest before it propagates. Only the region's own cleanup failure is raised.
        """
        self._shut_down = True
        handler_failed = False
        interrupt: BaseException | None = None
        steps: list[tuple[str, Callable[[], object]]] = [
            ("Failed to stop the offloading transfers", lambda: faults.point("cleanup.worker")),
            ("Failed to shut down store offloading handler", self._store_handler.shutdown),
            ("Failed to shut down load offloading handler", self._load_handler.shutdown),
            ("Failed to shut down load offloading handler", self._expedited_load_handler.shutdown),
        ]
        if self._copy_threads is not None:
            steps.append(("Failed to stop the copy threads", self._copy_threads.close))
        for failure, step in steps:
            try:
                step()
            except Exception:
                log.exception(failure)
                handler_failed = True
            except BaseException as e:
                log.exception(failure)
                handler_failed = True
                interrupt = interrupt or e
        region, self._mmap_region = self._mmap_region, None
        if region is not None:
            # Host copies ended when they returned; only a device may still write into the region.
            if handler_failed and not self._on_host:
                try:
                    import torch

                    torch.accelerator.synchronize()
                except Exception:
                    log.warning(
                        "Device sync before mmap cleanup failed; proceeding with cleanup anyway",
                        exc_info=True,
                    )
            try:
                region.cleanup()
            finally:
                if interrupt is not None:
                    raise interrupt
        if interrupt is not None:
            raise interrupt


__all__ = [
    "HAS_TRITON",
    "MAX_HOST_REGISTER_CHUNK_BYTES",
    "MIN_HOST_REGISTER_SAVED_BYTES",
    "CPUOffloadingWorker",
    "PinnableRegion",
    "SingleDirectionOffloadingHandler",
    "Transfer",
    "WorkerRegion",
    "pin_mmap_region",
]
